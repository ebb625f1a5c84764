"""The router's live dashboard (`/dashboard`) and `tsukimi top`."""
