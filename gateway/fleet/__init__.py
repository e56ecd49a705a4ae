"""The fleet's session directory in Redis: which gateway holds each session, and the signed records it keeps."""
