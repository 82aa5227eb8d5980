"""``python -m nybble`` runs the command line."""
import sys

from nybble.cli import main

sys.exit(main())
