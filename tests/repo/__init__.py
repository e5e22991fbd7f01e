"""The repository itself: the import rules of the architecture, the docs' snippets and
tables, the installed wheel."""
