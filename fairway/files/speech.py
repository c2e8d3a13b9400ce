"""Recordings to text with an offline speech model: PocketSphinx's US English model (acoustic
model, pronouncing dictionary and language model), shipped inside the `pocketsphinx` wheel, so
nothing is fetched at run time. Runs in the file reader's child process, bounded like any parse.

Only PCM WAV is decoded (the standard library's `wave`): the compressed types (MP3, Ogg, FLAC,
M4A, WebM) would need a codec library this server does not carry, so they are refused with a 415
that says to convert them.
"""

from __future__ import annotations

import importlib.util
import io
import wave

import numpy as np

RATE = 16000  # the model's sample rate
SPEECH_EXTRA = "pip install 'fairway[speech]'"


def speech_available() -> str | None:
    """None when recordings can be transcribed here, else why not."""
    if importlib.util.find_spec("pocketsphinx") is None:
        return f"no offline speech model is installed ({SPEECH_EXTRA} brings PocketSphinx and its English model)"
    return None


def wav_samples(data: bytes, max_seconds: float) -> np.ndarray:
    """A PCM WAV file's samples as mono int16 at RATE. ValueError with the reason otherwise."""
    try:
        with wave.open(io.BytesIO(data)) as w:
            rate, channels, width, frames = w.getframerate(), w.getnchannels(), w.getsampwidth(), w.getnframes()
            if rate <= 0 or channels <= 0:
                raise ValueError("the WAV header is invalid")
            if frames / rate > max_seconds:
                raise ValueError(f"the recording is {frames / rate:.0f} s long; at most {max_seconds:g} s are "
                                 "transcribed")
            raw = w.readframes(frames)
    except (wave.Error, EOFError) as e:
        raise ValueError(f"only PCM WAV audio can be transcribed: {e}") from None
    samples = _as_float(raw, width)
    samples = samples[: len(samples) - len(samples) % channels].reshape(-1, channels).mean(axis=1)
    return np.clip(_resample(samples, rate), -32768, 32767).astype(np.int16)


def _as_float(raw: bytes, width: int) -> np.ndarray:
    """Samples scaled to int16's range, whatever the file's sample width."""
    if width == 1:  # 8-bit WAV is unsigned
        return (np.frombuffer(raw, np.uint8).astype(np.float32) - 128.0) * 256.0
    if width == 2:
        return np.frombuffer(raw, "<i2").astype(np.float32)
    if width == 3:
        b = np.frombuffer(raw[: len(raw) - len(raw) % 3], np.uint8).reshape(-1, 3).astype(np.int32)
        value = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
        return (np.where(value >= 1 << 23, value - (1 << 24), value) / 256.0).astype(np.float32)
    if width == 4:
        return (np.frombuffer(raw, "<i4") / 65536.0).astype(np.float32)
    raise ValueError(f"WAV samples of {width} bytes are not supported")


def _resample(samples: np.ndarray, rate: int) -> np.ndarray:
    """To RATE by linear interpolation; a box filter first when it goes down, against aliasing."""
    if rate == RATE or samples.size == 0:
        return samples
    if rate > RATE:
        width = int(round(rate / RATE))
        if width > 1:
            samples = np.convolve(samples, np.full(width, 1.0 / width, np.float32), mode="same")
    out_n = int(samples.size * RATE / rate)
    return np.interp(np.arange(out_n) * (rate / RATE), np.arange(samples.size), samples).astype(np.float32)


def transcribe(data: bytes, max_seconds: float) -> str:
    """The words of a WAV recording, one sentence per stretch of speech between pauses."""
    from pocketsphinx import Decoder, Segmenter

    pcm = wav_samples(data, max_seconds).tobytes()
    decoder = Decoder(samprate=RATE, loglevel="FATAL")
    sentences = []
    for segment in Segmenter(sample_rate=RATE).segment(io.BytesIO(pcm)):
        decoder.start_utt()
        decoder.process_raw(segment.pcm, full_utt=True)
        decoder.end_utt()
        words = decoder.hyp().hypstr.strip() if decoder.hyp() is not None else ""
        if words:
            sentences.append(words[0].upper() + words[1:] + ".")
    return " ".join(sentences)
