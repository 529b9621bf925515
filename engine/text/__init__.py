"""Text in and out: the tokenizer, chat templates, streaming detokenization, prompt checks."""
