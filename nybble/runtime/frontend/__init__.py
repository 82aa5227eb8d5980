"""The API process's half: async engine, core client, request gate, outputs (torch-free)."""
