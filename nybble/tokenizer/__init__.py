"""Text handling: tokenizer, chat templates, incremental detokenization."""
