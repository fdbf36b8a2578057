"""Training of the shipped models: tokenizer, data stream, LLaDA SFT and SDAR block diffusion."""
