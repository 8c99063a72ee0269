"""NumPy reference: the model (SPEC sections 1-2), DDTree (section 3) and the decode loops."""
