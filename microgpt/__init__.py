"""ANDREA's Python side: the training proxy and the tools around the engines (docs/DESIGN.md §1)."""
