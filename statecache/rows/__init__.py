"""Rows: the row contract (contract), checking a row into the one form it keeps to its answer (check), text rows
rendered with the model's chat template (text), images in rows (images) and the memo of answered rows (memo).
Knows nothing of the model's weights, the cache or how a row is run."""
