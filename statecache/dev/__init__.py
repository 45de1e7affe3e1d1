"""For development and the built-in default model: random Hugging Face checkpoints made by transformers (checkpoints)
and the tiny model with its tokenizer (tiny). The runtime imports only the tiny model's maker, for its default."""
