"""``heal``: distil a decomposed model back towards the dense model it came from."""
