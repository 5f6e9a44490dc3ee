"""`/v1/audio/speech`: its body, the text that keeps arriving in an NDJSON
body, and the audio encoders (WAV, PCM, FLAC, MP3, Opus) of what it sends."""
