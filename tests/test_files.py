"""Files: sniffing, chunking and bounded parsing; the service on a local directory and on S3 (moto's
server on loopback, pre-signed uploads); and the whole path through `fairway serve`'s app with the
real model: a PDF's page-3 fact reaches the context of a conversation that attaches it."""

from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from pdf_maker import bomb_pdf, make_pdf
from serving import (
    API_KEY,
    MODEL,
    OTHER_KEY,
    TEST_KEYS,
    ThreadServer,
    free_port,
    headers,
    wait_for,
    wait_ready,
)

from fairway.conversation import database_url
from fairway.conversation.extras import TurnInfo
from fairway.files import sniff as kinds
from fairway.files.extract import ExtractionFailed, ExtractLimits, chunk_pages, extract_pages
from fairway.files.listing import FileQuery, UnknownCursor
from fairway.files.objects import LocalObjectStore, S3ObjectStore
from fairway.files.service import FileRejected, FileService, FileSettings
from fairway.files.source import FileSource
from fairway.files.speech import speech_available
from fairway.files.store import FileRecord, FileStore
from fairway.retrieval import CONVERSATION_CHUNKS, FILE_CHUNKS, SqlVectorIndex

pytest_plugins = ["vector_backends"]  # its fixtures: the databases, the embedder

DATA = Path(__file__).parent / "data"
LISTER_KEY = "sk-test-files-lister"  # a user of the module's server with no other test's files
FACT = "The access code for the Zebra warehouse is PURPLE-MONKEY-42."
PAGES = ["Quarterly report. Sales grew in the north region and shrank in the south. " * 8,
         "Staffing. The team hired four engineers and one designer this quarter. " * 8,
         "Facilities. " + FACT + " Deliveries arrive on Tuesdays.",
         "Outlook. Next quarter focuses on customer retention and lower costs. " * 8]


def test_content_is_sniffed_not_trusted_from_the_name():
    assert kinds.sniff(make_pdf(["x"]), "notes.txt") == kinds.PDF
    assert kinds.sniff(b"\x89PNG\r\n\x1a\n....", "a.pdf") == kinds.PNG
    assert kinds.sniff("héllo wörld\n".encode(), "a.bin") == kinds.TEXT
    assert kinds.sniff(b"# Title\n\ntext", "README.md") == kinds.MARKDOWN
    assert kinds.sniff(b"RIFF\x24\x00\x00\x00WAVEfmt ", "a.txt") == "audio/wav"
    assert kinds.sniff(b"\x00\x00\x00\x20ftypM4A \x00\x00", "voice.bin") == "audio/mp4"
    assert kinds.sniff(b"\x1a\x45\xdf\xa3\x9f\x42\x86\x81", "note") == "audio/webm"
    assert all(kind in kinds.AUDIO for kind in ("audio/mp4", "audio/webm"))  # 415: only WAV is transcribed
    assert kinds.sniff(b"\x00\x01\x02binary\x00", "a.txt") == "application/octet-stream"


def test_chunks_stay_within_a_page_and_overlap():
    text = " ".join(f"Sentence number {i} says something." for i in range(60))
    chunks = chunk_pages([(1, text), (2, "Short second page.")], max_chars=300, overlap=60)
    assert all(len(c.text) <= 300 for c in chunks)
    assert [c.n for c in chunks] == list(range(len(chunks)))
    assert chunks[-1].page == 2 and chunks[-1].text == "Short second page."
    first, second = chunks[0].text, chunks[1].text
    assert second.split(" ")[0] in first[-60:]  # the next chunk starts inside the last one's tail
    assert all(c.page == 1 for c in chunks[:-1])
    # a NUL in extracted text (a PDF's text layer) is no text: PostgreSQL could not store the chunk
    assert [c.text for c in chunk_pages([(1, "Total:\x00 42\x00units.")])] == ["Total: 42 units."]


async def test_parsing_is_bounded_and_failures_have_reasons():
    pages = await extract_pages(make_pdf(PAGES), kinds.PDF, ExtractLimits())
    assert [p for p, _ in pages] == [1, 2, 3, 4] and FACT in pages[2][1]
    with pytest.raises(ExtractionFailed, match="could not be parsed|could not be read"):
        await extract_pages(b"%PDF-1.4\n1 0 obj << /Type /Catalog", kinds.PDF, ExtractLimits())
    t = time.monotonic()
    with pytest.raises(ExtractionFailed, match="longer than"):
        await extract_pages(make_pdf(PAGES), kinds.PDF, ExtractLimits(timeout_s=0.01))
    assert time.monotonic() - t < 5
    with pytest.raises(ExtractionFailed):  # 96 MiB inflated: pypdf's inflate cap or the memory limit stops it
        await extract_pages(bomb_pdf(96), kinds.PDF, ExtractLimits(memory_bytes=400 << 20, max_chars=1 << 20))


@pytest.fixture(scope="module")
def s3_endpoint():
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture(params=["local", "s3"])
async def files(request, tmp_path, embedder, s3_endpoint):
    if request.param == "local":
        objects = LocalObjectStore(tmp_path / "files")
    else:
        objects = S3ObjectStore(f"fw-{time.time_ns()}", endpoint_url=s3_endpoint, create_bucket=True,
                                region_name="us-east-1", aws_access_key_id="test", aws_secret_access_key="test")
    url = f"sqlite+aiosqlite:///{tmp_path}/fairway.db"
    service = FileService(FileStore(url), objects, SqlVectorIndex(url), lambda: embedder,
                          FileSettings(max_file_bytes=256 << 10, max_user_bytes=600 << 10, max_user_files=5))
    await service.init()
    yield service
    await service.close()


async def test_upload_processes_and_is_per_user(files: FileService):
    record = await files.upload("u1", "report.pdf", make_pdf(PAGES), "multimodal_input")
    assert record.status == "processing" and record.content_type == kinds.PDF
    await files.wait_processed()
    ready = await files.get("u1", record.file_id)
    assert ready.status == "ready" and ready.chunks >= 4
    assert await files.get("u2", record.file_id) is None
    assert (await files.content("u1", record.file_id))[1] == make_pdf(PAGES)
    broken = await files.upload("u1", "broken.pdf", b"%PDF-1.7\n" + b"\x00garbage" * 50, "multimodal_input")
    await files.wait_processed()
    failed = await files.get("u1", broken.file_id)
    assert failed.status == "failed" and "PDF" in failed.status_details
    with pytest.raises(FileRejected) as big:
        await files.upload("u1", "big.txt", b"a" * (300 << 10), "multimodal_input")
    assert (big.value.status, big.value.code) == (413, "file_too_large")
    with pytest.raises(FileRejected) as ogg:  # audio, but not a type this server decodes
        await files.upload("u1", "talk.wav", b"OggS\x00\x02" + b"\x00" * 64, "multimodal_input")
    assert ogg.value.status == 415 and "convert this audio/ogg file to WAV" in ogg.value.message
    with pytest.raises(FileRejected) as binary:
        await files.upload("u1", "x.txt", b"\x7fELF\x02\x01\x00\x00" * 10, "multimodal_input")
    assert binary.value.status == 415
    for i in range(2):
        await files.upload("u1", f"n{i}.txt", b"b" * (200 << 10), "multimodal_input")
    with pytest.raises(FileRejected) as quota:  # 600 KiB per user
        await files.upload("u1", "more.txt", b"c" * (200 << 10), "multimodal_input")
    assert quota.value.code == "storage_quota_exceeded"
    assert await files.delete("u1", record.file_id) and not await files.delete("u1", record.file_id)
    assert await files.get("u1", record.file_id) is None
    for i in range(5):  # the count per user (5 here)
        await files.upload("u3", f"note{i}.txt", b"a short note", "multimodal_input")
    with pytest.raises(FileRejected) as count:
        await files.upload("u3", "note5.txt", b"one too many", "multimodal_input")
    assert (count.value.status, count.value.code) == (413, "too_many_files")
    await files.wait_processed()


async def test_deleting_a_file_or_a_conversation_leaves_no_chunks(files: FileService):
    """A deleted file's chunks go from its own partition and from every conversation it was attached
    to; a deleted conversation's copies go, the file stays and attaches elsewhere."""
    source = FileSource(files)
    kept = await files.upload("u1", "kept.txt", "\n\n".join(PAGES).encode(), "multimodal_input")
    dropped = await files.upload("u1", "dropped.txt", "\n\n".join(PAGES).encode(), "multimodal_input")
    await files.wait_processed()
    for conversation in ("conv_a", "conv_b"):
        extras = await source.extras(TurnInfo("u1", conversation, False, "the warehouse code?",
                                              [kept.file_id, dropped.file_id]))
        assert {s["file_id"] for s in extras.info["sources"]} <= {kept.file_id, dropped.file_id}
    chunks = (await files.get("u1", kept.file_id)).chunks
    assert await files.index.count(CONVERSATION_CHUNKS, "conv_a") == 2 * chunks

    assert await files.delete("u1", dropped.file_id)
    assert await files.index.count(FILE_CHUNKS, dropped.file_id) == 0
    for conversation in ("conv_a", "conv_b"):
        assert await files.index.count(CONVERSATION_CHUNKS, conversation) == chunks  # the kept file's

    await files.forget_conversation("conv_a")
    assert await files.index.count(CONVERSATION_CHUNKS, "conv_a") == 0
    assert await files.store.attached("conv_a") == {}
    assert await files.index.count(FILE_CHUNKS, kept.file_id) == chunks  # the file itself stays
    assert await files.index.count(CONVERSATION_CHUNKS, "conv_b") == chunks


async def test_a_file_sent_without_a_question_is_shown_from_its_start(files: FileService):
    """Files dropped in with no question: there is nothing to retrieve for, so the model gets each
    file's opening chunks (taken in turns, so one long file does not crowd out the other, within the
    retrieval budget), shown file by file in document order and named in the sources."""
    source = FileSource(files)
    long = await files.upload("u1", "long.txt", "\n\n".join(PAGES * 3).encode(), "multimodal_input")
    short = await files.upload("u1", "short.txt", b"Shopping list: eggs, flour, sugar.", "multimodal_input")
    await files.wait_processed()
    extras = await source.extras(TurnInfo("u1", "conv_q", True, "  ", [long.file_id, short.file_id],
                                          lambda text: len(text) // 4))
    sources = [(s["filename"], s["chunk"]) for s in extras.info["sources"]]
    long_chunks = [n for name, n in sources if name == "long.txt"]
    assert sources == [("long.txt", n) for n in long_chunks] + [("short.txt", 0)]
    assert long_chunks == list(range(len(long_chunks))) and len(long_chunks) > 1
    assert (await files.get("u1", long.file_id)).chunks > len(long_chunks)  # the budget, not the whole file
    (block,) = extras.retrieved
    assert block["content"].index("[long.txt, chunk 0]") < block["content"].index("[short.txt, chunk 0]")
    assert "Quarterly report" in block["content"] and "eggs, flour" in block["content"]
    # a later turn without a question and without files of its own adds nothing
    assert (await source.extras(TurnInfo("u1", "conv_q", False, "", []))).retrieved == []
    # A question no chunk of the files it sends is near ("summarise this"): their beginning too; a
    # later one with no near chunk and no file of its own, nothing.
    files.settings.retrieve_min_score = 0.99  # nothing is near
    extras = await source.extras(TurnInfo("u1", "conv_s", True, "Summarise this.", [short.file_id], len))
    assert [(s["filename"], s["chunk"], s["score"]) for s in extras.info["sources"]] == [("short.txt", 0, None)]
    assert (await source.extras(TurnInfo("u1", "conv_s", False, "Summarise this.", [], len))).retrieved == []


@pytest.fixture
async def file_store(vector_db):
    url, connect_args = vector_db
    store = FileStore(database_url(url), connect_args)
    await store.init()
    yield store
    await store.close()


async def test_files_are_paged_in_the_database_stably(file_store: FileStore):
    """Pages by (created_at, id), on SQLite and PostgreSQL: files uploaded in the same instant still
    come once each, in one order, whichever way and however small the pages."""
    made = []
    for i in range(7):
        record = FileRecord(f"file_{i:02d}x", "u1", f"f{i}.txt", "user_data" if i % 3 else "assistants",
                            "text/plain", 10, "ready", None, 1, f"u1/f{i}", 1000.0 + i // 3)  # ties of three
        await file_store.add(record)
        made.append(record.file_id)
    await file_store.add(FileRecord("file_theirs", "u2", "x.txt", "user_data", "text/plain", 1, "ready", None, 1,
                                    "u2/x", 1001.0))
    newest_first = sorted(made, key=lambda f: (1000 + int(f[5:7]) // 3, f), reverse=True)

    async def all_pages(limit: int, order: str, purpose: str | None = None) -> list[str]:
        seen, after = [], None
        while True:
            page = await file_store.page("u1", FileQuery(limit, after, order, purpose))
            seen += [r.file_id for r in page.records]
            if not page.has_more:
                return seen
            after = seen[-1]

    for limit in (1, 2, 3, 7, 100):
        assert await all_pages(limit, "desc") == newest_first
        assert await all_pages(limit, "asc") == newest_first[::-1]
    assert await all_pages(2, "desc", "assistants") == [f for f in newest_first if int(f[5:7]) % 3 == 0]
    whole = await file_store.page("u1", FileQuery())
    assert [r.file_id for r in whole.records] == newest_first and not whole.has_more
    for unknown in ("file_theirs", "file_never"):
        with pytest.raises(UnknownCursor):
            await file_store.page("u1", FileQuery(after=unknown))


async def test_an_image_is_read_by_ocr(files: FileService):
    if files.ocr_off:
        pytest.skip(files.ocr_off)
    import io

    from PIL import Image, ImageDraw, ImageFont

    image = Image.new("RGB", (900, 120), "white")
    ImageDraw.Draw(image).text((10, 30), "The parking code is 7351.", fill="black",
                               font=ImageFont.load_default(size=48))
    png = io.BytesIO()
    image.save(png, "PNG")
    record = await files.upload("u1", "photo.txt", png.getvalue(), "multimodal_input")  # the name lies
    assert record.content_type == kinds.PNG
    await files.wait_processed()
    assert (await files.get("u1", record.file_id)).status == "ready"
    hit = (await files.index.search("file_chunks", record.file_id, (await files.embed(["parking code"]))[0], 1))[0]
    assert "7351" in hit.text


async def test_a_recording_is_transcribed_offline(files: FileService):
    """A WAV voice memo (synthesised speech, 16 kHz mono) is transcribed by PocketSphinx's model from
    its wheel; its words become chunks like a document's. A WAV that is not PCM fails with a reason."""
    if files.speech_off:
        pytest.skip(files.speech_off)
    record = await files.upload("u1", "memo.bin", (DATA / "speech_memo.wav").read_bytes(), "multimodal_input")
    assert (record.status, record.content_type) == ("processing", kinds.WAV)
    header_only = await files.upload("u1", "cut.wav", b"RIFF\x24\x00\x00\x00WAVEfmt " + b"\x07" * 64,
                                     "multimodal_input")
    await files.wait_processed()
    assert (await files.get("u1", record.file_id)).status == "ready"
    query = (await files.embed(["What is the warehouse access code?"]))[0]
    hit = (await files.index.search(FILE_CHUNKS, record.file_id, query, 1))[0]
    assert "purple monkey forty two" in hit.text.lower() and hit.meta["page"] is None
    failed = await files.get("u1", header_only.file_id)
    assert failed.status == "failed" and "WAV" in failed.status_details


async def test_without_a_speech_model_audio_is_a_415_that_says_so(files: FileService):
    files.speech_off = speech_available() or "no offline speech model is installed (as on a server without it)"
    with pytest.raises(FileRejected) as audio:
        await files.upload("u1", "talk.wav", (DATA / "speech_memo.wav").read_bytes(), "multimodal_input")
    assert audio.value.status == 415 and "no offline speech model is installed" in audio.value.message


async def test_presigned_upload_goes_straight_to_the_store(files: FileService):
    data = "\n\n".join(PAGES).encode()
    if not files.objects.presigned:
        with pytest.raises(FileRejected, match="S3"):
            await files.create_upload("u1", "notes.txt", len(data), "multimodal_input")
        return
    record, url = await files.create_upload("u1", "notes.txt", len(data), "multimodal_input")
    assert record.status == "awaiting_upload"
    with pytest.raises(FileRejected, match="Nothing has been uploaded"):
        await files.complete_upload("u1", record.file_id)
    async with httpx.AsyncClient() as client:  # the client, to the object store: no gateway involved
        put = await client.put(url, content=data, headers={"Content-Type": "application/octet-stream"})
    assert put.status_code == 200
    assert await files.complete_upload("u2", record.file_id) is None
    assert (await files.complete_upload("u1", record.file_id)).status == "processing"
    await files.wait_processed()
    done = await files.get("u1", record.file_id)
    assert (done.status, done.content_type, done.bytes) == ("ready", kinds.TEXT, len(data))


# -- end to end ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory, embedder, s3_endpoint):
    """`fairway serve --files s3://bucket` on moto's server (the local directory store serves the
    chat page's and the authorization tests' servers)."""
    import boto3

    from fairway.assembly import ServerOptions, embedded_app

    root = tmp_path_factory.mktemp("files")
    bucket = f"fw-e2e-{time.time_ns()}"
    with pytest.MonkeyPatch.context() as env:
        for name, value in {"AWS_ENDPOINT_URL": s3_endpoint, "AWS_ACCESS_KEY_ID": "test",
                            "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}.items():
            env.setenv(name, value)
        boto3.client("s3").create_bucket(Bucket=bucket)
        options = ServerOptions(database=f"sqlite:///{root}/fairway.db", max_model_len=2048,
                                api_keys=[*TEST_KEYS, (LISTER_KEY, "files-lister", "paid")],
                                files=f"s3://{bucket}",
                                file_settings=FileSettings(max_file_bytes=512 << 10))
        app = embedded_app(options)
        server = ThreadServer(app).start()
        wait_ready(server.url)
    yield server
    server.stop()


def test_a_pdf_fact_on_page_3_reaches_the_conversation_that_attaches_it(server):
    http = httpx.Client(base_url=server.url, headers=headers(), timeout=120)
    up = http.post("/v1/files/upload", files={"file": ("report.pdf", make_pdf(PAGES), "application/pdf")},
                   data={"purpose": "multimodal_input"})
    assert up.status_code == 200, up.text
    body = up.json()
    assert body["upload_status"] == "success" and body["file_id"].startswith("file_")
    file_id = body["file_id"]
    assert httpx.get(body["access_url"]).content == make_pdf(PAGES)  # pre-signed: straight from the store
    wait_for(lambda: http.get(f"/v1/files/{file_id}").json()["status"] == "ready", timeout=90)
    other = httpx.Client(base_url=server.url, headers=headers(OTHER_KEY), timeout=30)
    assert other.get(f"/v1/files/{file_id}").status_code == 404
    assert other.get(f"/v1/files/{file_id}/content").status_code == 404
    assert http.get(f"/v1/files/{file_id}/content").content == make_pdf(PAGES)

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    reply = client.chat.completions.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": [
        {"type": "text", "text": "What is the access code for the Zebra warehouse?"},
        {"type": "file_url", "file_id": file_id}]}])
    sources = reply.model_extra["context"]["sources"]
    assert sources and sources[0]["file_id"] == file_id and sources[0]["page"] == 3
    assert sources[0]["filename"] == "report.pdf"
    stored = http.get(f"/v1/replies/{reply.id}").json()
    assert stored["sources"][0]["page"] == 3 and stored["sources"][0]["chunk"] == sources[0]["chunk"]
    # and with the conversation, reopened later: each answer with the chunks it was given
    history = http.get(f"/v1/conversations/{reply.conversation_id}").json()["messages"]
    answer = next(m for m in history if m.get("reply_id") == reply.id)
    assert answer["context"]["sources"] == stored["sources"]
    assert "context" not in history[0]  # the user's message
    # a later turn of the conversation retrieves again for its own question, no file part needed
    later = client.chat.completions.create(model=MODEL, max_tokens=4, extra_body={
        "conversation_id": reply.conversation_id}, messages=[{"role": "user", "content": "Which region grew sales?"}])
    assert later.model_extra["context"]["sources"][0]["page"] == 1
    # another user cannot attach it; an unknown id is 404; OpenAI's file part shape works too
    denied = other.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "file", "file": {"file_id": file_id}}, {"type": "text", "text": "hi"}]}]})
    assert denied.status_code == 404 and denied.json()["error"]["code"] == "file_not_found"
    assert http.delete(f"/v1/files/{file_id}").json()["deleted"] is True
    gone = client.chat.completions.create(model=MODEL, max_tokens=2, extra_body={
        "conversation_id": reply.conversation_id}, messages=[{"role": "user", "content": "And the access code?"}])
    assert not gone.model_extra["context"].get("sources")


def test_upload_errors_are_openai_shaped(server):
    http = httpx.Client(base_url=server.url, headers=headers(), timeout=60)

    def upload(content: bytes, name: str = "f.txt", **data):
        return http.post("/v1/files", files={"file": (name, content)}, data={"purpose": "user_data", **data})

    listed = upload(b"plain text notes")
    assert listed.status_code == 200 and listed.json()["object"] == "file"
    assert listed.json()["id"] in [f["id"] for f in http.get("/v1/files").json()["data"]]
    too_big = upload(b"x" * (600 << 10))
    assert too_big.status_code == 413 and too_big.json()["error"]["code"] in ("file_too_large", "request_too_large")
    mp3 = upload(b"ID3\x04\x00\x00" + b"\x00" * 32, "a.wav")
    assert mp3.status_code == 415 and mp3.json()["error"]["type"] == "invalid_request_error"
    assert "WAV" in mp3.json()["error"]["message"]
    utf16 = upload("notes in UTF-16".encode("utf-16"))  # text, but not in the encoding read here
    assert utf16.status_code == 415 and "UTF-8" in utf16.json()["error"]["message"]
    bad_purpose = upload(b"text", purpose="nonsense")
    assert bad_purpose.status_code == 400 and bad_purpose.json()["error"]["param"] == "purpose"
    malformed = http.post("/v1/files/upload", content=b"--xx\r\nContent-Disposition: form-data; name=\"file\"\r\n",
                          headers={"Content-Type": "multipart/form-data; boundary=xx"})
    assert malformed.status_code == 400 and "error" in malformed.json()
    missing = http.post("/v1/files/upload", data={"purpose": "multimodal_input"})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "file"
    broken = http.post("/v1/files/upload", files={"file": ("b.pdf", b"%PDF-1.5\n\x00\x01 not a pdf")})
    file_id = broken.json()["file_id"]
    record = wait_for(lambda: (r := http.get(f"/v1/files/{file_id}").json())["status"] != "processing" and r, 60)
    assert record["status"] == "failed" and record["status_details"]
    not_ready = http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "file_url", "file_id": file_id}, {"type": "text", "text": "hi"}]}]})
    assert not_ready.status_code == 409 and not_ready.json()["error"]["code"] == "file_not_ready"
    too_big_presign = http.post("/v1/files/uploads", json={"filename": "big.pdf", "bytes": 600 << 10})
    assert too_big_presign.status_code == 413 and too_big_presign.json()["error"]["code"] == "file_too_large"
    assert http.get("/v1/health").status_code in (200, 404)  # the server is still up
    paths = httpx.get(f"{server.url}/openapi.json").json()["paths"]
    assert {"413", "415", "400"} <= set(paths["/v1/files/upload"]["post"]["responses"])


def test_a_voice_memo_attached_in_chat_is_cited(server):
    http = httpx.Client(base_url=server.url, headers=headers(), timeout=120)
    up = http.post("/v1/files/upload", files={"file": ("memo.wav", (DATA / "speech_memo.wav").read_bytes())})
    if up.status_code == 415:  # no speech model here: the 415 says so
        assert "speech model" in up.json()["error"]["message"]
        pytest.skip(up.json()["error"]["message"])
    file_id = up.json()["file_id"]
    wait_for(lambda: http.get(f"/v1/files/{file_id}").json()["status"] == "ready", timeout=90)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    reply = client.chat.completions.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": [
        {"type": "text", "text": "What did my voice memo say the warehouse code is?"},
        {"type": "file_url", "file_id": file_id}]}])
    sources = reply.model_extra["context"]["sources"]
    assert [(s["file_id"], s["filename"], s["chunk"]) for s in sources] == [(file_id, "memo.wav", 0)]


def test_a_large_file_goes_from_the_client_straight_to_the_object_store(server):
    """The seed's large-file path: the gateway hands out a pre-signed URL, the client PUTs the bytes
    to the store (no gateway in between), says it is done, and the server processes it after."""
    http = httpx.Client(base_url=server.url, headers=headers(), timeout=120)
    data = "\n\n".join(PAGES).encode()
    upload = http.post("/v1/files/uploads", json={"filename": "notes.md", "bytes": len(data)}).json()
    file_id = upload["file_id"]
    assert upload["file"]["status"] == "awaiting_upload"
    early = http.post(f"/v1/files/{file_id}/complete")
    assert early.status_code == 400 and early.json()["error"]["code"] == "upload_missing"
    put = httpx.put(upload["upload_url"], content=data, headers=upload["headers"])
    assert put.status_code == 200
    other = httpx.Client(base_url=server.url, headers=headers(OTHER_KEY), timeout=30)
    assert other.post(f"/v1/files/{file_id}/complete").status_code == 404
    assert http.post(f"/v1/files/{file_id}/complete").json()["status"] == "processing"
    ready = wait_for(lambda: (r := http.get(f"/v1/files/{file_id}").json())["status"] == "ready" and r, 90)
    assert (ready["bytes"], ready["content_type"]) == (len(data), "text/markdown")  # sniffed after
    assert http.get(f"/v1/files/{file_id}/content").content == data


def test_the_sdk_pages_through_files_and_stops(server):
    """OpenAI's SDK auto-paginates files.list() by `after=<last id>` until has_more is false: each
    file exactly once, then it stops. limit, order, purpose and after behave; another user's files
    never appear, and their id is no cursor."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=LISTER_KEY, max_retries=0, timeout=60)
    other = openai.OpenAI(base_url=f"{server.url}/v1", api_key=OTHER_KEY, max_retries=0, timeout=60)
    theirs = other.files.create(file=("theirs.txt", b"not yours"), purpose="user_data").id
    mine = [client.files.create(file=(f"note{i}.txt", f"note {i}".encode()),
                                purpose="assistants" if i % 4 == 0 else "user_data").id for i in range(9)]
    newest_first = mine[::-1]

    assert [f.id for f in itertools.islice(client.files.list(limit=2), 500)] == newest_first
    assert [f.id for f in itertools.islice(client.files.list(), 500)] == newest_first
    first = client.files.list(limit=2)
    assert [f.id for f in first.data] == newest_first[:2] and first.has_more
    assert (first.first_id, first.last_id) == (newest_first[0], newest_first[1])
    assert [f.id for f in client.files.list(order="asc", limit=4).data] == mine[:4]
    assert [f.id for f in client.files.list(after=newest_first[2]).data] == newest_first[3:]
    assert [f.id for f in client.files.list(purpose="assistants")] == [mine[8], mine[4], mine[0]]
    last = client.files.list(after=mine[0])
    assert (last.data, last.has_more, last.first_id) == ([], False, None)
    assert theirs not in [f.id for f in client.files.list()]
    with pytest.raises(openai.BadRequestError) as cursor:
        client.files.list(after=theirs)
    assert (cursor.value.body["param"], cursor.value.body["code"]) == ("after", "invalid_cursor")
    http = httpx.Client(base_url=server.url, headers=headers(LISTER_KEY), timeout=30)
    for params in ({"limit": 0}, {"limit": 10_001}, {"limit": "two"}, {"order": "sideways"}):
        bad = http.get("/v1/files", params=params)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == next(iter(params)), bad.text
    documented = httpx.get(f"{server.url}/openapi.json").json()["paths"]["/v1/files"]["get"]
    assert {p["name"] for p in documented["parameters"]} == {"limit", "after", "order", "purpose"}
    assert {"200", "400", "401", "503"} <= set(documented["responses"])


def test_a_file_sent_alone_is_shown_to_the_model(server):
    """A ChatGPT user drops a file in and sends it, no question: the model sees the file's start
    (the prompt holds it) and the reply's context names the chunks, as a retrieved turn's does."""
    http = httpx.Client(base_url=server.url, headers=headers(), timeout=120)
    file_id = http.post("/v1/files", files={"file": ("report.pdf", make_pdf(PAGES))},
                        data={"purpose": "user_data"}).json()["id"]
    wait_for(lambda: http.get(f"/v1/files/{file_id}").json()["status"] == "ready", timeout=90)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    reply = client.chat.completions.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": [
        {"type": "file_url", "file_id": file_id}]}])
    sources = reply.model_extra["context"]["sources"]
    assert [(s["file_id"], s["chunk"]) for s in sources] == [(file_id, n) for n in range(len(sources))]
    assert sources[0]["page"] == 1 and sources[0]["filename"] == "report.pdf"
    assert reply.usage.prompt_tokens > 200  # the file's first pages, not only the chat template
    assert http.get(f"/v1/replies/{reply.id}").json()["sources"] == sources


def test_a_reopened_conversation_lists_each_message_s_attached_files(server):
    """The files a turn attached are listed on that user message when the conversation is read
    back (not on the answer, nor on a later turn without files); a file deleted since stays listed,
    by name, marked deleted; another user still gets a 404 for the conversation."""
    http = httpx.Client(base_url=server.url, headers=headers(), timeout=120)
    note = b"The gate code of the north depot is 4471.\n"
    file_id = http.post("/v1/files", files={"file": ("depot notes.txt", note)}, data={"purpose": "user_data"}).json()["id"]
    wait_for(lambda: http.get(f"/v1/files/{file_id}").json()["status"] == "ready", timeout=90)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    reply = client.chat.completions.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": [
        {"type": "text", "text": "What is the gate code?"}, {"type": "file", "file": {"file_id": file_id}}]}])
    conversation_id = reply.model_extra["conversation_id"]
    client.chat.completions.create(model=MODEL, max_tokens=2, extra_body={"conversation_id": conversation_id},
                                   messages=[{"role": "user", "content": "Thanks."}])

    def attachments() -> list[tuple[str, Any]]:
        messages = http.get(f"/v1/conversations/{conversation_id}").json()["messages"]
        return [(m["role"], m.get("attachments")) for m in messages]

    listed = {"file_id": file_id, "filename": "depot notes.txt", "bytes": len(note), "content_type": "text/plain",
              "deleted": False}
    assert attachments() == [("user", [listed]), ("assistant", None), ("user", []), ("assistant", None)]
    other = httpx.Client(base_url=server.url, headers=headers(OTHER_KEY), timeout=30)
    assert other.get(f"/v1/conversations/{conversation_id}").status_code == 404
    assert http.delete(f"/v1/files/{file_id}").json()["deleted"] is True
    assert attachments()[0] == ("user", [{**listed, "deleted": True}])
    documented = httpx.get(f"{server.url}/openapi.json").json()
    ok = documented["paths"]["/v1/conversations/{conversation_id}"]["get"]["responses"]["200"]
    assert ok["content"]["application/json"]["schema"]["$ref"].endswith("/ConversationOut")
    schemas = documented["components"]["schemas"]
    assert "attachments" in schemas["ConversationMessageOut"]["properties"]
    assert set(schemas["AttachmentOut"]["required"]) == set(listed)


def test_identical_requests_attaching_different_files_are_not_one_shared_generation(server):
    """Identical greedy requests in flight together share one reply (single flight), but not when
    they attach different files: each reply's context holds its own file's chunks."""
    http = httpx.Client(base_url=server.url, headers=headers(), timeout=120)
    ids = []
    for name, text in (("north.txt", b"The north depot's gate code is 4471.\n"),
                       ("south.txt", b"The south depot's gate code is 9035.\n")):
        ids.append(http.post("/v1/files", files={"file": (name, text)}, data={"purpose": "user_data"}).json()["id"])
    for file_id in ids:
        wait_for(lambda file_id=file_id: http.get(f"/v1/files/{file_id}").json()["status"] == "ready", timeout=90)

    def body(file_id: str) -> dict:
        return {"model": MODEL, "stream": True, "temperature": 0, "max_tokens": 24, "ignore_eos": True,
                "messages": [{"role": "user", "content": [{"type": "text", "text": "What is the gate code?"},
                                                          {"type": "file_url", "file_id": file_id}]}]}

    async def together(*bodies: dict) -> list[tuple[str, str | None]]:
        async with httpx.AsyncClient(base_url=server.url, headers=headers(), timeout=120) as client:
            async def one(b: dict) -> tuple[str, str | None]:
                async with client.stream("POST", "/v1/chat/completions", json=b) as r:
                    assert r.status_code == 200, await r.aread()
                    async for _ in r.aiter_lines():
                        pass
                    return r.headers["x-reply-id"], r.headers.get("x-shared-generation")
            return await asyncio.gather(*(one(b) for b in bodies))

    same = asyncio.run(together(body(ids[0]), body(ids[0])))
    assert same[0][0] == same[1][0] and [s for _, s in same].count("true") == 1  # (they were in flight together)
    different = asyncio.run(together(body(ids[0]), body(ids[1])))
    assert different[0][0] != different[1][0] and not any(s for _, s in different)
