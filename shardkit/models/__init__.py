"""Models composed from ``shardkit.parallel``: ``vit`` (the sharded ViT; takes vit_ref's params)."""
