"""signaling"""
