"""Data: reading records (files, save_to_disk folders), formats and loss masks, tokenize-once cache, packing,
and the one data order (DistributedSampler's) every training path uses."""
