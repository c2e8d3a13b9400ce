"""The child process that parses one untrusted file (extract.extract_pages starts it): the bytes
on stdin, {"pages": [[page, text], ...]} or {"error": reason} on stdout."""

from __future__ import annotations

import json
import sys

from fairway.files.extract import ExtractionFailed, ExtractLimits, pages_of


def main() -> None:
    args = json.loads(sys.argv[1])
    limits = ExtractLimits(max_pages=args["max_pages"], max_chars=args["max_chars"], max_audio_s=args["max_audio_s"])
    data = sys.stdin.buffer.read()
    try:
        answer = {"pages": pages_of(data, args["type"], limits)}
    except ExtractionFailed as e:
        answer = {"error": str(e)}
    except MemoryError:
        answer = {"error": "reading the file needed more memory than allowed"}
    except Exception as e:  # a parser's own bug on a malformed file
        answer = {"error": f"the file could not be read: {type(e).__name__}: {e}"}
    sys.stdout.write(json.dumps(answer))


if __name__ == "__main__":
    main()
