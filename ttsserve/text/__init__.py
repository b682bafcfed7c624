"""Text front end: tokenizer (tokenizer.py), prompt strings and per-position inputs (prompt.py),
normalization (normalize.py: the reference rules; expand.py, numbers.py, units.py: verbalisation),
long-text splitting (split.py), speaker/audio-prompt strings (speaker.py, base16384.py).

Modules are imported explicitly (`from ttsserve.text.normalize import normalize_text`); importing the
package itself loads nothing heavy.
"""
