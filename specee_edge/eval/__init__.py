"""`specee-edge eval`: task figures of each quality level against plain decoding, paired on the same problems."""
