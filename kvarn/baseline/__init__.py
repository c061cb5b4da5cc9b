"""The baseline's data: the evaluation text cut in chunks, and the dump of the BF16 run's log-probs (its row encoding, sparse rows, the file, behind one protocol)."""
