import os

# Tests never touch the network: a stray hub call fails at once instead of retrying for ~25 s.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
