"""Generated from protos/kvtier/v1/kvtier.proto by scripts/gen_proto.sh; do not edit."""
