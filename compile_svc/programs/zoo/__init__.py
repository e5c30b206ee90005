"""Published architectures at their published sizes (GPT-2 XL, BERT-large, Llama-style 7B,
ViT-L/16), described by shape alone: for planning, never for materialising weights here.

Each module holds a config dataclass, the published config and a tiny one for tests, and
builds a Network from a config; entries.py turns a network into a registered model program.
"""
