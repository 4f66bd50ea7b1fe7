"""attempts.abandoned: nodes given up on while their host was away, as a column instead of a search in JSON

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('attempts', schema=None) as batch_op:
        batch_op.add_column(sa.Column('abandoned', sa.Boolean(), nullable=False, server_default=sa.false()))
        batch_op.create_index(batch_op.f('ix_attempts_abandoned'), ['abandoned'], unique=False)
    # rows written before this revision kept the mark only in the nodes' JSON
    op.execute(sa.text("""UPDATE attempts SET abandoned = :yes WHERE CAST(nodes AS TEXT) LIKE '%"abandoned"%'""")
               .bindparams(yes=True))
    with op.batch_alter_table('attempts', schema=None) as batch_op:
        batch_op.alter_column('abandoned', server_default=None)


def downgrade() -> None:
    with op.batch_alter_table('attempts', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_attempts_abandoned'))
        batch_op.drop_column('abandoned')
