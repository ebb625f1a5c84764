"""The store master: a pure state machine and the servers that wrap it."""
