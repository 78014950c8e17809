import sys
import mindspore
from mindspore import nn
from mindspore.nn import Cell
from mindspore.ops import functional as F
#
#
sys.path.insert(0, '/work/main/.venv/lib/python3.11/site-packages/mindspore/nn/layer')
from mindspore import ops
from mindspore.nn.cell import Cell
from basic import Dense
from mindspore.train.amp import amp_cast

class DenseOpt_5(Dense, Cell):

    def __init__(self, obj):
        Cell.__init__(self)
        for key, value in obj.__dict__.items():
            setattr(self, key, value)

    def construct(self, x):
        x_var = amp_cast(x, mindspore.float16)
        x_shape = self.shape_op(x_var)
        x_shape = amp_cast(x_shape, mindspore.float32)
        len_var_1 = len(x_shape)
        compare_var_1 = len_var_1 != 2
        if compare_var_1:
            subscript_var = x_shape[-1]
            usub_var = -1
            tuple_var = (usub_var, subscript_var)
            x_var_4 = amp_cast(x, mindspore.float16)
            tuple_var = amp_cast(tuple_var, mindspore.float16)
            x = self.reshape(x_var_4, tuple_var)
            x = amp_cast(x, mindspore.float32)
        x_var_1 = amp_cast(x, mindspore.float16)
        weight_var = amp_cast(self.weight, mindspore.float16)
        x = self.matmul(x_var_1, weight_var)
        x = amp_cast(x, mindspore.float32)
        if self.has_bias:
            x_var_3 = amp_cast(x, mindspore.float16)
            bias_var = amp_cast(self.bias, mindspore.float16)
            x = self.bias_add(x_var_3, bias_var)
            x = amp_cast(x, mindspore.float32)
        if self.activation_flag:
            x = self.activation(x)
        len_var = len(x_shape)
        compare_var = len_var != 2
        if compare_var:
            subscript_var_2 = ops.shape(x)[-1]
            tuple_var_1 = (subscript_var_2,)
            subscript_var_1 = x_shape[:-1]
            out_shape = subscript_var_1 + tuple_var_1
            x_var_2 = amp_cast(x, mindspore.float16)
            out_shape = amp_cast(out_shape, mindspore.float16)
            x = self.reshape(x_var_2, out_shape)
            x = amp_cast(x, mindspore.float32)
        return x

    def extend_repr(self):
        s = f'input_channels={self.in_channels}, output_channels={self.out_channels}'
        if self.has_bias:
            s += f', has_bias={self.has_bias}'
        if self.activation_flag:
            s += f', activation={self.activation}'
        return s
#
sys.path.insert(0, '/work/wt/zb/tests/runtime')
from test_zb_exact import Head

class HeadOpt_1(Head, nn.Cell):

    def __init__(self, obj) -> None:
        nn.Cell.__init__(self)
        for key, value in obj.__dict__.items():
            setattr(self, key, value)
        self.out = DenseOpt_5(self.out)

    def construct(self, x):
        ifexp_var = x if self.inner is None else self.inner(x)
        out_var = self.out(ifexp_var)
        return out_var
#