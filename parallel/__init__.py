"""How work is split across ranks and how ranks talk. Knows nothing of any model."""
