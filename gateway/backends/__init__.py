"""The application's side of a session: a backend's WebSocket, or a ConversationRelay app Voxgate dials."""
