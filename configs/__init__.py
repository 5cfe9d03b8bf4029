"""Training recipes, accelerate and DeepSpeed templates.

Installed as the package ``mosaics.recipes`` (data only); look them up by name with
``mosaics configs list`` or :mod:`mosaics.shipped_configs`.
"""
