"""Host interconnect: the all-reduce table measured on a host, the probe asked for, and why the last one failed

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('hosts', schema=None) as batch_op:
        batch_op.add_column(sa.Column('interconnect', sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column('interconnect_wanted_tp', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('interconnect_error', sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('hosts', schema=None) as batch_op:
        batch_op.drop_column('interconnect_error')
        batch_op.drop_column('interconnect_wanted_tp')
        batch_op.drop_column('interconnect')
