"""The model: Qwen3.5's config (config), its weights read from a Hugging Face checkpoint (loader), the hybrid forward
over packed sequences (forward), the vision tower (vision), transformers' own module for the oracle (hf) and the
specialists' LoRA adapters and router (specialists). Knows nothing of rows, the cache or scheduling."""
