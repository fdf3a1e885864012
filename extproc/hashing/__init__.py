"""Request content -> block keys: prefix chains, media content hashes, token estimates."""
