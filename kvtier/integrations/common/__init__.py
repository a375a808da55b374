"""What every engine integration shares and no engine's API is needed for (pure, or I/O only
through `kvtier.client`)."""
