from fastapi import APIRouter, status

from server import hosts
from server.api.deps import ReadSession, WriteSession
from server.schemas import HostCreate, HostPublic

router = APIRouter(prefix="/hosts", tags=["hosts"])


@router.post("", status_code=status.HTTP_201_CREATED)
def register_host(body: HostCreate, session: WriteSession) -> HostPublic:
    return hosts.host_public(hosts.register_host(session, body))


@router.get("")
def list_hosts(session: ReadSession) -> list[HostPublic]:
    return [hosts.host_public(h) for h in hosts.list_hosts(session)]


@router.get("/{name}")
def get_host(name: str, session: ReadSession) -> HostPublic:
    return hosts.host_public(hosts.get_host(session, name))
