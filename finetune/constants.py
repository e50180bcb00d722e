"""Values that more than one layer must agree on, each written once."""

# The label of a token that carries no loss (prompt tokens, padding, the gap between packed records): the data
# pipeline writes it, every loss skips it. -100 is the ignore_index of torch's cross_entropy and of transformers'
# models, so their own losses skip the same tokens.
IGNORE_INDEX = -100
