"""The built-in GPT's size presets (--model_size), in a module of their own: the command line
(common/builtin_flags.py) lists and checks them without importing the model."""

# name: (n_layer, n_head, n_embd, block_size)
MODEL_PRESETS = {
    "tiny": (2, 4, 64, 64),  # tests: a 20-step run takes seconds on one core
    "small": (4, 4, 128, 128),  # the CPU demo (default main job)
    "gpt2": (12, 12, 768, 1024),  # GPT-2 shapes (85M here: the byte vocabulary has 256 rows, not 50257)
    "gpt2-medium": (24, 16, 1024, 1024),  # GPT-2 medium shapes (~303M here)
    "1b": (24, 16, 2048, 2048),  # ~1.2B, for GPUs
}
