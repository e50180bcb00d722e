"""Values that more than one layer must agree on, each written once."""

import re

# The label of a token that carries no loss (prompt tokens, padding, the gap between packed records): the data
# pipeline writes it, every loss skips it. -100 is the ignore_index of torch's cross_entropy and of transformers'
# models, so their own losses skip the same tokens.
IGNORE_INDEX = -100
# The batch key of the trained positions' flat indices in the shifted labels (labels[..., 1:] and a -100 at each row's
# end, flattened): the collator computes them on the host, so the chunked loss needs no device sync to find them.
TRAINED_ROWS = "trained_rows"

# A Hub repo id, model or data set: org/name, one "/" and letters, digits, "-", "_", "." (a leading "." or "/" means a
# local path). finetune.models.hub and finetune.data.sources add their own rules on top (a local path always wins).
REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*/[A-Za-z0-9][A-Za-z0-9_.\-]*$")
# A commit on the Hub: 40 hex digits (the HF cache names its snapshot folders by it).
COMMIT = re.compile(r"^[0-9a-f]{40}$")
