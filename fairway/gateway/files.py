"""Files: the seed's POST /v1/files/upload (§2.2), OpenAI's /v1/files routes, and pre-signed
uploads straight to the object store for large files (POST /v1/files/uploads, then .../complete).
Each user sees only their own files: another user's id is a 404 like an unknown one."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, File, Form, Query, Request, UploadFile
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from fairway.files.listing import MAX_LIMIT, FileQuery, Order, UnknownCursor
from fairway.files.service import FileRejected, FileService
from fairway.files.store import FileRecord
from fairway.gateway.app_state import gateway
from fairway.gateway.auth import authenticated, user_id
from fairway.gateway.errors import ApiError, error_responses, invalid, not_found

router = APIRouter(dependencies=[Depends(authenticated)])


class UploadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    filename: str = Field(min_length=1, max_length=255)
    bytes: int = Field(gt=0)
    purpose: str = "multimodal_input"


def _files(request: Request) -> FileService:
    files = gateway(request).files
    if files is None:
        raise ApiError(503, "Files are off on this server (the embedding model is not installed).",
                       code="files_unavailable")
    return files


def _rejected(e: FileRejected) -> ApiError:
    return ApiError(e.status, e.message, param=e.param, code=e.code)


def _missing(file_id: str) -> ApiError:
    return not_found(f"No file {file_id!r}.", "file_id", "file_not_found")


async def _upload(request: Request, file: UploadFile, purpose: str) -> FileRecord:
    files = _files(request)
    data = await file.read(files.settings.max_file_bytes + 1)
    try:
        return await files.upload(user_id(request), file.filename or "upload", data, purpose)
    except FileRejected as e:
        raise _rejected(e) from None


def _access_url(request: Request, files: FileService, record: FileRecord) -> str:
    own = str(request.url_for("file_content", file_id=record.file_id))
    return files.objects.access_url(record.object_key, own)


@router.post("/v1/files/upload", responses=error_responses(401, 400, 413, 415, 503))
async def upload_file(request: Request, file: Annotated[UploadFile, File()],
                      purpose: Annotated[str, Form()] = "multimodal_input") -> dict[str, Any]:
    """The seed's upload: multipart `file` + `purpose`. Processing goes on after the answer:
    `status` is processing, then ready or failed (GET /v1/files/{file_id})."""
    record = await _upload(request, file, purpose)
    return {"file_id": record.file_id, "upload_status": "success", "status": record.status,
            "access_url": _access_url(request, _files(request), record), "filename": record.filename,
            "bytes": record.bytes, "content_type": record.content_type}


@router.post("/v1/files", responses=error_responses(401, 400, 413, 415, 503))
async def create_file(request: Request, file: Annotated[UploadFile, File()],
                      purpose: Annotated[str, Form()]) -> dict[str, Any]:
    """OpenAI's upload: answers the file object (status processing)."""
    return (await _upload(request, file, purpose)).openai()


@router.post("/v1/files/uploads", responses=error_responses(401, 400, 413, 503))
async def create_upload(body: UploadRequest, request: Request) -> dict[str, Any]:
    """A pre-signed upload for a large file: PUT the bytes to upload_url (with the headers given),
    then POST /v1/files/{file_id}/complete."""
    files = _files(request)
    try:
        record, url = await files.create_upload(user_id(request), body.filename, body.bytes, body.purpose)
    except FileRejected as e:
        raise _rejected(e) from None
    return {"file_id": record.file_id, "upload_url": url, "method": "PUT",
            "headers": {"Content-Type": "application/octet-stream"},
            "expires_at": int(record.created_at + files.settings.presign_expires_s), "file": record.openai()}


@router.post("/v1/files/{file_id}/complete", responses=error_responses(401, 400, 404, 413, 503))
async def complete_upload(file_id: str, request: Request) -> dict[str, Any]:
    try:
        record = await _files(request).complete_upload(user_id(request), file_id)
    except FileRejected as e:
        raise _rejected(e) from None
    if record is None:
        raise _missing(file_id)
    return record.openai()


@router.get("/v1/files", responses=error_responses(401, 400, 503))
async def list_files(
    request: Request,
    limit: Annotated[int, Query(ge=1, le=MAX_LIMIT, description="Files per page.")] = MAX_LIMIT,
    after: Annotated[str | None, Query(max_length=64, description=(
        "A file id from the previous page (its last_id): the page starts after it. Not one of your files: 400."))] = None,
    order: Annotated[Order, Query(description="By created_at, newest first (desc) or oldest first.")] = "desc",
    purpose: Annotated[str | None, Query(max_length=64, description="Only files of this purpose.")] = None,
) -> dict[str, Any]:
    """Your files, a page at a time (OpenAI's list: first_id, last_id, has_more)."""
    query = FileQuery(limit, after, order, purpose)
    try:
        return (await _files(request).page(user_id(request), query)).openai()
    except UnknownCursor:
        raise invalid(f"after: no file {after!r} to list after (use a file id from a previous page).",
                      "after", "invalid_cursor") from None


@router.get("/v1/files/{file_id}", responses=error_responses(401, 404, 503))
async def get_file(file_id: str, request: Request) -> dict[str, Any]:
    record = await _files(request).get(user_id(request), file_id)
    if record is None:
        raise _missing(file_id)
    return record.openai()


@router.get("/v1/files/{file_id}/content", name="file_content", responses=error_responses(401, 404, 503))
async def file_content(file_id: str, request: Request) -> Response:
    found = await _files(request).content(user_id(request), file_id)
    if found is None:
        raise _missing(file_id)
    record, data = found
    return Response(data, media_type=record.content_type,
                    headers={"Content-Disposition": f'attachment; filename="{record.file_id}"'})


@router.delete("/v1/files/{file_id}", responses=error_responses(401, 404, 503))
async def delete_file(file_id: str, request: Request) -> dict[str, Any]:
    if not await _files(request).delete(user_id(request), file_id):
        raise _missing(file_id)
    return {"id": file_id, "object": "file", "deleted": True}
