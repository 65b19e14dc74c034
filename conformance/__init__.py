"""The conformance suite: checks with stable IDs, golden reference data, report bundle."""
