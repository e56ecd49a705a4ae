import numpy as np


def load_wav(path, target_sr):
    return np.zeros((1, target_sr // 10), dtype=np.float32)
