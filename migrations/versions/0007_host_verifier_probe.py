"""Host verifier probe: the verifier layer timing asked for (config, tp, ep) and why the last one failed; and where
the worker last reached the host (user@address:port, its ~/.ssh/config applied)

Revision ID: 0007
Revises: 0006
"""

import sqlalchemy as sa
from alembic import op

revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('hosts', schema=None) as batch_op:
        batch_op.add_column(sa.Column('verifier_wanted', sa.JSON(none_as_null=True), nullable=True))
        batch_op.add_column(sa.Column('verifier_error', sa.Text(), nullable=True))
        batch_op.add_column(sa.Column('reached', sa.String(length=512), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('hosts', schema=None) as batch_op:
        batch_op.drop_column('reached')
        batch_op.drop_column('verifier_error')
        batch_op.drop_column('verifier_wanted')
