"""pretrain: long-context pretraining with linear-time token mixers."""
