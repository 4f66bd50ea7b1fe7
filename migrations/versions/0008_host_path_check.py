"""Host path check: the input paths a submit asks about, and what the worker found on the host

Revision ID: 0008
Revises: 0007
"""

import sqlalchemy as sa
from alembic import op

revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('hosts', schema=None) as batch_op:
        batch_op.add_column(sa.Column('paths_wanted', sa.JSON(none_as_null=True), nullable=True))
        batch_op.add_column(sa.Column('paths_found', sa.JSON(none_as_null=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('hosts', schema=None) as batch_op:
        batch_op.drop_column('paths_found')
        batch_op.drop_column('paths_wanted')
