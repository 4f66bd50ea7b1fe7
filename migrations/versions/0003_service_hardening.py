"""Service hardening: worker steps that failed in a row, the server-side time a step moved, the stall mark,
and skipped metric lines

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('step_failures', sa.Integer(), nullable=False, server_default='0'))
    with op.batch_alter_table('attempts', schema=None) as batch_op:
        batch_op.add_column(sa.Column('step_seen_at', sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column('stalled_at', sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column('metrics_skipped', sa.Integer(), nullable=False, server_default='0'))


def downgrade() -> None:
    with op.batch_alter_table('attempts', schema=None) as batch_op:
        batch_op.drop_column('metrics_skipped')
        batch_op.drop_column('stalled_at')
        batch_op.drop_column('step_seen_at')
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.drop_column('step_failures')
