"""The `infer` command line: one thin module per verb (parse, call the library, print)."""
