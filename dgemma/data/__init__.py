"""Data: tokenizers, chat templates, corpora, `data prepare`, token shards and fine-tuning rows."""
