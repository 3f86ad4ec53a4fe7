"""Text for the long-context recipes: no-download tokenizers, local corpora through `datasets`, token
windows, passkey retrieval, and the long-context evaluation (loss by position, passkey accuracy)."""
