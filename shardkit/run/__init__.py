"""What the ``shardkit`` commands do: ``verify`` (sharded == reference)."""
