"""voxgate"""
