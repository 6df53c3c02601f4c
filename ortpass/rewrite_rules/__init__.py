"""onnxscript pattern-rewrite rules that ortpass's passes apply (one module per rule family)."""
