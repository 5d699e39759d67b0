"""Decode-sized GEMMs for a persistent decode layer (Mosaic GPU): `mosaic_gpu.py`."""
