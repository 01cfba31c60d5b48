"""fsdp2.tools: see inside a sharded run and plan one (docs/tools.md)."""
