"""The fleet's session directory in Redis: which gateway holds each session, in signed records."""
