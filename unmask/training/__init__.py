"""Training of the embedded default model: tokenizer, data stream, LLaDA SFT objective."""
